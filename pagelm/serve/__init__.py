"""The HTTP server: OpenAI- and Ollama-compatible routes over one engine worker."""
