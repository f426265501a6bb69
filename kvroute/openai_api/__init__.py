"""The OpenAI wire format both sides speak: request schemas (``schema``) and error objects (``errors``)."""
