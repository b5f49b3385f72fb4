"""KV caches: the full cache and window rings (kv), the offloaded cache, the retrieval
level's cache, the drafters' streaming cache, and the stores that outlive a run (prefix,
disk)."""
