"""Model loading: GGUF files (`metrale.loading.gguf`) and the default model's location
(`metrale.loading.default_model`)."""
