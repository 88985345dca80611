"""The torch-free core: request state, the paged KV block manager and the scheduler."""
