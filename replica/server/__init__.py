"""The replica's HTTP face: the app and its routes (``app``), OpenAI replies (``openai_serving``), metrics."""
