"""kvcache package."""
