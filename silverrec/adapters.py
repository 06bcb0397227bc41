"""Adapters: a user's own trained modules behind `RecModel`'s stage interfaces (publish/byo.py
loads the modules and builds these).

    UserTowerAdapter       (values, lengths, dense) -> float32 [B, T, D], the request's canonical item
                           rows mapped to what the user's tower was trained on
    OverArchAdapter        item_side / score / item_width around (user, cand, feats) -> [B, K] | [B, K, T]
    MaskedOverArchAdapter  the same for a module that also takes valid bool [B, K] (a list-wise one)

They live in the snapshot's program like every other stage: no host work, static shapes.
`train()` sets only the adapter's own flag: an unlifted torch.export program refuses `train()`, and
a user's module stays in the eval mode it was loaded in.
"""

import torch
from torch import Tensor, nn


class UserTowerAdapter(nn.Module):
    """A user's tower behind RecModel's user-tower interface.

    (values int64 [nnz], lengths int32 [F * B], dense float32 [B, Fd]) -> float32 [B, T, D]: the
    request's item keys (the first two, hist_item and recent_item) hold canonical rows; they are
    mapped through `item_input` int64 [N] (canonical row -> what the user's tower was trained on)
    before the call, and a [B, D] output becomes [B, 1, D].
    """

    def __init__(self, module: nn.Module, item_input: Tensor):
        super().__init__()
        self.module = module
        self.register_buffer("item_input", item_input.to(torch.int64))

    script_directly = True  # publish/rec.py `scriptable`: torch.jit.script it as it is (no fx trace)

    def train(self, mode: bool = True) -> "UserTowerAdapter":
        """Sets this module's flag only: an unlifted torch.export program refuses `train()`, and the
        user's module stays in the eval mode it was loaded in."""
        self.training = mode
        return self

    def user_values(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        """values int64 [nnz] with the item keys' canonical rows mapped to the tower's item inputs."""
        B = dense.shape[0]
        item_values = lengths[: 2 * B].sum()  # item keys come first (key-major values)
        is_item = torch.arange(values.shape[0], device=values.device) < item_values
        n = self.item_input.shape[0]
        return torch.where(is_item, self.item_input[values.clamp(0, n - 1)], values)

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        out = self.module(self.user_values(values, lengths, dense), lengths, dense)
        if out.dim() == 2:
            out = out.unsqueeze(1)
        return out.float()


class OverArchAdapter(nn.Module):
    """A user's OverArch behind RecModel's OverArch interface (`item_side` / `score` / `item_width`).

    It has no item-side split, so its item side is the identity: [cand, feats] [.., D + F], kept per
    item by the embedding cache (`with_ranker`); `score` splits it again and calls the module
    with (user [B, T, D], cand [B, K, D], feats [B, K, F]) -> [B, K] (every task) | [B, K, T].
    """

    def __init__(self, module: nn.Module, dim: int, feat_dim: int, tasks: int):
        super().__init__()
        self.module = module
        self.dim, self.feat_dim, self.tasks = int(dim), int(feat_dim), int(tasks)

    def train(self, mode: bool = True) -> "OverArchAdapter":
        self.training = mode  # not recursive (UserTowerAdapter.train)
        return self

    @property
    def item_width(self) -> int:
        return self.dim + self.feat_dim

    @torch.jit.export
    def item_side(self, cand: Tensor, feats: Tensor) -> Tensor:
        """cand [.., D], feats [.., F] -> [.., D + F]."""
        return torch.cat([cand.float(), feats.float()], dim=-1)

    def call(self, user: Tensor, cand: Tensor, feats: Tensor, valid: Tensor) -> Tensor:
        return self.module(user, cand, feats)

    def score(self, user: Tensor, cand: Tensor, item: Tensor, valid: Tensor) -> Tensor:
        """user float32 [B, T, D], cand float32 [B, K, D], item [B, K, D + F], valid bool [B, K] ->
        float32 [B, K, T]."""
        feats = item[:, :, self.dim :].float()
        out = self.call(user.float(), cand.float(), feats, valid)
        if out.dim() == 2:
            out = out.unsqueeze(2).expand(-1, -1, self.tasks)
        return out.float()


class MaskedOverArchAdapter(OverArchAdapter):
    """`OverArchAdapter` for a module that also takes valid bool [B, K] (`mask = true`)."""

    def call(self, user: Tensor, cand: Tensor, feats: Tensor, valid: Tensor) -> Tensor:
        return self.module(user, cand, feats, valid)
