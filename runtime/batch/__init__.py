"""Many sequences at once: each keeps its own caches, speculation and sampling; their model
forwards run together.

- `rows.py`: the ragged forward. Rows of several sequences (a decode's one, a
  verification's γ+1, a draft step's) go through the linears in one call, each row at its
  own position, and attend per sequence over that sequence's own cache (`Ragged`).
- `runner.py`: the batch. Each sequence runs the solo code path (`api.generate`: any mode)
  in a member thread; its model forwards wait at a rendezvous (`Batcher`) until every
  member has one, then run as one ragged forward per model. A sequence's output does not
  depend on the batch: every row is computed as it would be alone (row-exact linears,
  attention per sequence), so each sequence's tokens equal its solo run's.
"""
