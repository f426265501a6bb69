"""What several test groups share: real processes, chats, command-line parsing."""
