"""The paged KV runtime: block manager, block table, KV pool, model, engine and hot-swap."""
