"""Text and serving over the token-id Engine, in a room of their own: the checkpoint's tokenizer
and chat template, incremental detokenisation and stop strings (``TextEngine``), the loops that
own an engine and step it while requests arrive (``EngineLoop``, ``EngineProcess``), and the
OpenAI-compatible HTTP API over them (``openai_api``, which needs the ``serve`` extra)."""
