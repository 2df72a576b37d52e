"""A model replica whose embedding tables live row-sharded on the parameter shards (ps/slicer.py, ps/tables.py).

The dense parameters behave exactly as in ``WholeModel``: views into one flat vector that fetches write and
pushes read. The tables are different, because a minibatch touches a few thousand of their millions of rows:

- **fetch**: just before a table's forward, the replica fetches the rows of that table its minibatch uses and
  does not already hold fresh (rows fetched since the last dense fetch count as fresh: with ``fetch_every`` n a
  row is refreshed at most every n steps, as the paper's fetch). A model that defines ``embedding_ids(x)`` (a
  list with one id tensor per table, in the model's module order) has all its tables' rows fetched in one call
  per shard before the forward; otherwise a forward pre-hook on each table fetches that table's rows.
- **push**: the tables compute row-sparse gradients (the replica's copy of each table is switched to
  ``sparse=True``, which changes the gradient's layout, not its values); after each step the replica sums
  duplicate ids and keeps ``(unique ids, values)`` per table until the next push, which carries them with the
  dense gradient (``rows=``). Untouched rows never travel.

The local copy of a table is full size (unfetched rows are never read); only the rows a minibatch uses are ever
written into it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from distbelief.ps.sharding import bind_flat


class SparseModel:
    """A gradient source (see downpour/replica.py ``GradientSource``) for a model with embedding tables.

    Args:
        slicer: the run's ``ps.slicer.Slicer`` (the client's layout).
        client: the replica's ShardClient (rows are fetched through it in the middle of a forward).
        local_lr: the paper's local step alpha, applied to the fetched rows of the tables too.
        timeout_s: bound on each row fetch.
    """

    lo = 0

    def __init__(self, replica_id: int, model: torch.nn.Module,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], slicer, client,
                 local_lr: float = 0.0, timeout_s: float = 120.0):
        self.name = f"replica {replica_id}"
        self.model, self.loss_fn, self.slicer, self.client = model, loss_fn, slicer, client
        self.local_lr, self.timeout_s = local_lr, timeout_s
        self.modules = [model.get_submodule(spec.module) for spec in slicer.tables]
        for m in self.modules:
            m.sparse = True  # row-sparse gradients: the same values, without a dense table-sized gradient
        self.weights = [m.weight for m in self.modules]
        table_ids = {id(w) for w in self.weights}
        self.dense = [p for p in model.parameters() if id(p) not in table_ids]
        self.flat, self.grads = bind_flat(model, params=self.dense)
        self.params = self.flat
        self._fresh = [torch.zeros(spec.num_rows, dtype=torch.bool) for spec in slicer.tables]
        self._fresh_ids: list[list[torch.Tensor]] = [[] for _ in slicer.tables]
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in slicer.tables]
        self.rows_fetched = 0
        self.rows_pushed = 0
        self.row_fetch_calls = 0
        self._batched = callable(getattr(model, "embedding_ids", None))
        self._hooks = [] if self._batched else [
            m.register_forward_pre_hook(self._pre_hook(t)) for t, m in enumerate(self.modules)]

    # -- fetching rows
    def _missing(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        u = torch.unique(ids.reshape(-1).long())  # sorted
        return u[~self._fresh[t][u]] if u.numel() and int(u[0]) >= 0 and int(u[-1]) < self._fresh[t].numel() else u

    def _load(self, requests: list) -> None:
        """Fetch ``requests[t]`` (sorted unique ids, or None) of each table and write them into the local copy."""
        if all(r is None or not len(r) for r in requests):
            return
        asked = [None if r is None or not len(r) else r.numpy() for r in requests]
        values = self.client.fetch_rows_async(asked).result(self.timeout_s)  # ValueError for an id out of range
        self.row_fetch_calls += 1
        with torch.no_grad():
            for t, (ids, v) in enumerate(zip(requests, values)):
                if v is None:
                    continue
                self.weights[t].index_copy_(0, ids, torch.from_numpy(v))
                self._fresh[t][ids] = True
                self._fresh_ids[t].append(ids)
                self.rows_fetched += len(ids)

    def _pre_hook(self, t: int):
        def hook(module, inputs):
            requests = [None] * len(self.modules)
            requests[t] = self._missing(t, inputs[0])
            self._load(requests)
        return hook

    def on_fetch(self) -> None:
        """The dense parameters were fetched: every row is due for a refresh at its next use."""
        for t, lists in enumerate(self._fresh_ids):
            for ids in lists:
                self._fresh[t][ids] = False
            lists.clear()

    # -- one step
    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self._batched:
            self._load([self._missing(t, ids) for t, ids in enumerate(self.model.embedding_ids(x))])
        self.grads.zero_()
        for w in self.weights:
            w.grad = None  # sparse gradients accumulate by concatenation: start each step empty
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        for t, w in enumerate(self.weights):
            if w.grad is None:
                continue
            g = w.grad.coalesce()  # duplicate ids summed
            ids, vals = g.indices()[0], g.values()
            self._pending[t].append((ids, vals))
            if self.local_lr:
                with torch.no_grad():
                    w.index_add_(0, ids, vals, alpha=-self.local_lr)
        return loss.item()

    def take_rows(self) -> list:
        """The row-sparse gradient accrued since the last push, per table ``(ids, values)`` as numpy (sorted
        unique int64 ids, float32 values) or None; the accrual starts again."""
        out = []
        for t, pending in enumerate(self._pending):
            if not pending:
                out.append(None)
                continue
            if len(pending) == 1:
                ids, vals = pending[0]
            else:
                dim = self.slicer.tables[t].dim
                cat_ids = torch.cat([i for i, _ in pending])
                cat_vals = torch.cat([v for _, v in pending])
                g = torch.sparse_coo_tensor(cat_ids[None], cat_vals, (self.slicer.tables[t].num_rows, dim),
                                            check_invariants=False).coalesce()
                ids, vals = g.indices()[0], g.values()
            pending.clear()
            self.rows_pushed += len(ids)
            out.append((ids.numpy().astype(np.int64, copy=False), vals.contiguous().numpy()))
        return out

    def agree(self, step: int, go: bool) -> bool:
        return go

    def adopt_buffers(self, buffers: tuple) -> bool:
        flat, grads = (torch.from_numpy(b) for b in buffers)
        self.flat, self.grads = bind_flat(self.model, flat, grads, params=self.dense)
        self.params = self.flat
        return True

    def module_buffers(self) -> dict[str, torch.Tensor]:
        from distbelief.buffers import buffers_of

        return {name: b.cpu() for name, b in buffers_of(self.model).items()}

    def stats(self) -> dict:
        return {"rows_fetched": self.rows_fetched, "rows_pushed": self.rows_pushed,
                "row_fetch_calls": self.row_fetch_calls}
