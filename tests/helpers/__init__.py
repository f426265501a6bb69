"""What several test groups share: waiting for a condition (``waiting``), reading Prometheus metrics
(``metrics``), real processes and whole stacks (``processes``), chats, command-line parsing."""
