"""`larqlpy serve`: an OpenAI-compatible HTTP server over the scheduler, whose sessions persist
(docs/serve.md)."""
