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

Tables of one width form a row group (ps/slicer.py): the replica keeps one local tensor per group, each table's
weight a view into it, so that fetching, writing, collecting and pushing a step's rows are a few operations per
group, not per table. The local copy is full size (unfetched rows are never read); only the rows a minibatch uses
are ever written into it. An id outside its table is a ValueError naming the table, raised before anything of
the step is fetched or pushed.
"""

from __future__ import annotations

from typing import Callable

import torch

from distbelief.ps.sharding import bind_flat


def _sum_duplicates(keys: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique sorted keys, their summed values)``: one stable sort and one sequential scatter-add for a whole
    row group, where coalescing each table's sparse gradient would cost a few small operations per table. Each
    key's values are added in the order they came (the stable sort keeps it), as torch's coalesce adds them."""
    order = torch.sort(keys, stable=True)[1]
    sorted_keys = keys[order]
    unique, inverse = torch.unique_consecutive(sorted_keys, return_inverse=True)
    out = torch.zeros(unique.numel(), vals.shape[1], dtype=vals.dtype)
    out.index_add_(0, inverse, vals[order])
    return unique, out


def _row_sparse(grad: torch.Tensor) -> torch.Tensor:
    """A table's gradient as a row-sparse COO tensor. A model that reads a table's weight itself (``F.embedding``
    on ``module.weight``) gets a dense gradient; its nonzero rows are the same update (a zero row changes neither
    the row nor its optimizer state under any rule here)."""
    return grad if grad.is_sparse else grad.to_sparse(1)


class SparseModel:
    """A gradient source (see downpour/replica.py ``GradientSource``) for a model with embedding tables.

    Args:
        slicer: the run's ``ps.slicer.Slicer`` (the client's layout).
        client: the replica's ShardClient (rows are fetched through it just before they are used).
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
        # One local tensor per row group; each table's weight is a view of its rows in it.
        self.group_w = [torch.empty(g.num_rows, g.dim, dtype=torch.float32) for g in slicer.groups]
        for spec, m in zip(slicer.tables, self.modules):
            m.sparse = True  # row-sparse gradients: the same values, without a dense table-sized gradient
            view = self.group_w[spec.group][spec.base: spec.base + spec.num_rows]
            view.copy_(m.weight.detach())
            m.weight.data = view
        self.weights = [m.weight for m in self.modules]
        table_ids = {id(w) for w in self.weights}
        self.dense = [p for p in model.parameters() if id(p) not in table_ids]
        self.flat, self.grads = bind_flat(model, params=self.dense)
        self.params = self.flat
        groups = slicer.groups
        self._rows = [torch.tensor([slicer.tables[t].num_rows for t in g.tables]) for g in groups]
        self._bases = [torch.tensor(g.bases) for g in groups]
        self._fresh = [torch.zeros(g.num_rows, dtype=torch.bool) for g in groups]
        self._fresh_keys: list[list[torch.Tensor]] = [[] for _ in groups]
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in groups]
        self.rows_fetched = 0
        self.rows_pushed = 0
        self.row_fetch_calls = 0
        self._batched = callable(getattr(model, "embedding_ids", None))
        self._hooks = [] if self._batched else [
            m.register_forward_pre_hook(self._pre_hook(t)) for t, m in enumerate(self.modules)]

    # -- ids to keys
    def _keys(self, g: int, ids: list[torch.Tensor], which: slice = slice(None)) -> torch.Tensor:
        """The sorted unique keys of row group ``g`` for ``ids[i]``, the ids (any shape) used in the i-th of the
        group's tables ``which`` selects (all by default); ValueError naming the table for an id outside it."""
        lens = torch.tensor([i.numel() for i in ids])
        flat = torch.cat([i.reshape(-1) for i in ids]).long()
        bad = (flat < 0) | (flat >= torch.repeat_interleave(self._rows[g][which], lens))
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            i = int(torch.searchsorted(lens.cumsum(0), pos, right=True))
            spec = self.slicer.tables[self.slicer.groups[g].tables[which][i]]
            raise ValueError(f"{spec.name()}: row id {int(flat[pos])} is out of range [0, {spec.num_rows})")
        return torch.unique(flat + torch.repeat_interleave(self._bases[g][which], lens))  # sorted

    # -- fetching rows
    def _load(self, keys: list) -> None:
        """Fetch the keys of each row group (sorted unique, or None) not fetched since the last dense fetch, and
        write them into the local copy."""
        requests = [None if k is None else k[~self._fresh[g][k]] for g, k in enumerate(keys)]
        requests = [None if r is None or not r.numel() else r for r in requests]
        if all(r is None for r in requests):
            return
        values = self.client.fetch_rows_async([None if r is None else r.numpy() for r in requests]).result(
            self.timeout_s)
        self.row_fetch_calls += 1
        with torch.no_grad():
            for g, (keys_g, v) in enumerate(zip(requests, values)):
                if keys_g is None:
                    continue
                self.group_w[g].index_copy_(0, keys_g, torch.from_numpy(v))
                self._fresh[g][keys_g] = True
                self._fresh_keys[g].append(keys_g)
                self.rows_fetched += len(keys_g)

    def _pre_hook(self, t: int):
        spec = self.slicer.tables[t]
        g, i = spec.group, self.slicer.groups[spec.group].tables.index(t)

        def hook(module, inputs):
            keys: list = [None] * len(self.slicer.groups)
            keys[g] = self._keys(g, [inputs[0]], slice(i, i + 1))  # this table alone
            self._load(keys)
        return hook

    def on_fetch(self) -> None:
        """The dense parameters were fetched: every row is due for a refresh at its next use."""
        for g, lists in enumerate(self._fresh_keys):
            for keys in lists:
                self._fresh[g][keys] = False
            lists.clear()

    # -- one step
    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self._batched:  # every table's rows in one fetch per shard, before the forward
            ids = self.model.embedding_ids(x)
            per_group = [[ids[t] for t in g.tables] for g in self.slicer.groups]
            self._load([self._keys(g, group_ids) for g, group_ids in enumerate(per_group)])
        self.grads.zero_()
        for w in self.weights:
            w.grad = None  # sparse gradients accumulate by concatenation: start each step empty
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        for g, group in enumerate(self.slicer.groups):
            parts = [(_row_sparse(self.weights[t].grad), self.slicer.tables[t].base) for t in group.tables
                     if self.weights[t].grad is not None]
            if not parts:
                continue
            keys, vals = _sum_duplicates(torch.cat([gr._indices()[0] + base for gr, base in parts]),
                                         torch.cat([gr._values() for gr, _ in parts]))
            stale = keys[~self._fresh[g][keys]]
            if stale.numel():  # a row computed with but never fetched: its table was used without its module
                spec = self.slicer.table_of(g, int(stale[0]))
                raise ValueError(f"{spec.name()} was read without calling its module (F.embedding on its weight?), "
                                 f"so its rows were never fetched from the parameter shards: call the module, or "
                                 f"define embedding_ids(x) on the model (docs/tables.md)")
            self._pending[g].append((keys, vals))
            if self.local_lr:
                with torch.no_grad():
                    self.group_w[g].index_add_(0, keys, vals, alpha=-self.local_lr)
        return loss.item()

    def take_rows(self) -> list:
        """The row-sparse gradient accrued since the last push, per row group ``(keys, values)`` as numpy (sorted
        unique int64 keys, float32 values) or None; the accrual starts again."""
        out = []
        for g, pending in enumerate(self._pending):
            if not pending:
                out.append(None)
                continue
            if len(pending) == 1:
                keys, vals = pending[0]
            else:
                group = self.slicer.groups[g]
                summed = torch.sparse_coo_tensor(torch.cat([k for k, _ in pending])[None],
                                                 torch.cat([v for _, v in pending]), (group.num_rows, group.dim),
                                                 check_invariants=False).coalesce()
                keys, vals = summed.indices()[0], summed.values()
            pending.clear()
            self.rows_pushed += len(keys)
            out.append((keys.numpy(), vals.contiguous().numpy()))
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
