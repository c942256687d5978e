"""Front ends over the pipeline: a chat session, C-Eval scoring, lm-eval's model, shared-prefix answers."""
