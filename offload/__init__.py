"""Host KV store, async copier, pipeline scheduler, tuner, cost model."""
