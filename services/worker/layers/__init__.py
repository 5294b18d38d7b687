"""Model building blocks: TP-aware linears and embeddings, norms, RoPE, paged attention."""
