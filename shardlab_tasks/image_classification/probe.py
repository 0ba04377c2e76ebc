"""Judge a trunk by its frozen features, as VISSL's benchmarks do: extract them once, then train a linear classifier
on them, or classify by the labels of the nearest training features (kNN).

The trunk runs once per image (``extract_features``); the linear probe's epochs and the kNN vote then work on the
cached (N, D) tensors only. Both are seeded and deterministic on the CPU. Any task that implements
``Task.features(model, images)`` can be judged this way (image classification, the self-supervised task).
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


# ---- features --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def extract_features(
    features_of,
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    device: torch.device,
    name: str = "features",
) -> tuple[Tensor, Tensor]:
    """(features (N, D) float32 on the CPU, labels (N,) int64) of every sample of ``dataset`` in order.

    ``features_of(images) -> (B, D)`` runs the trunk (already in eval mode); samples are (image, label, ...) as the
    image-classification datasets give them. Decoding runs in ``num_workers`` DataLoader processes while the trunk
    works, and progress goes to stderr about every 10 seconds (an ImageNet-sized folder takes a while)."""
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
    )
    total = len(dataset)
    features: Tensor | None = None
    labels = torch.empty(total, dtype=torch.long)
    done, started, reported = 0, time.perf_counter(), time.perf_counter()
    for batch in loader:
        images, batch_labels = batch[0], batch[1]
        out = features_of(images.to(device, non_blocking=True)).float().cpu()
        if features is None:  # the width is the trunk's: known after the first batch
            features = torch.empty(total, out.shape[1], dtype=torch.float32)
        features[done : done + len(out)] = out
        labels[done : done + len(out)] = batch_labels
        done += len(out)
        now = time.perf_counter()
        if now - reported >= 10 and done < total:
            rate = done / (now - started)
            print(
                f"{name}: {done}/{total} images, {rate:.0f} images/s, {(total - done) / rate:.0f} s left",
                file=sys.stderr,
                flush=True,
            )
            reported = now
    assert features is not None and done == total, "a dataset of at least one sample, read whole"
    return features, labels


@torch.no_grad()
def recompute_bn_stats(
    model: nn.Module,
    features_of,
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    device: torch.device,
) -> int:
    """Re-estimate every BatchNorm's running mean and variance on ``dataset`` (the train split, unaugmented): reset,
    then one pass in which each BN normalizes with its batch's statistics and accumulates them with momentum=None,
    torch's cumulative average (the mean over batches of each batch's mean and unbiased variance), as
    torch.optim.swa_utils.update_bn does. An untrained trunk's running statistics are those of its init (mean 0,
    variance 1), which no image has; judged with them, a random trunk is weaker than the architecture is.

    The BNs are put in training mode by a hook around their own forward, since ``features_of`` may put the model in
    eval mode itself (the self-supervised task's does); nothing else runs in training mode, and no gradient is kept.
    A BN the features do not pass through (a self-supervised head's) keeps its statistics. Returns the number of
    BatchNorm layers re-estimated."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    before = [(m.momentum, {k: v.clone() for k, v in m.state_dict().items()}) for m in norms]
    visited: set[int] = set()

    def batch_statistics(module, args):
        module.training = True
        visited.add(id(module))

    def back_to_eval(module, args, output):
        module.training = False

    hooks = []
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        hooks += [m.register_forward_pre_hook(batch_statistics), m.register_forward_hook(back_to_eval)]
    try:
        extract_features(features_of, dataset, batch_size, num_workers, device, name="BatchNorm statistics")
    finally:
        for hook in hooks:
            hook.remove()
        for m, (momentum, state) in zip(norms, before, strict=True):
            m.momentum, m.training = momentum, False
            if id(m) not in visited:  # not on the features' path (a projection head): left as it was
                m.load_state_dict(state)
    return len(visited)


def standardize(train: Tensor, *others: Tensor) -> list[Tensor]:
    """Every tensor shifted and scaled by the training features' per-dimension mean and std (as the BatchNorm in
    front of VISSL's linear head does at evaluation), so no trunk is judged by the scale of its features."""
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    return [(t - mean) / std for t in (train, *others)]


# ---- linear probe ----------------------------------------------------------------------------------------------------
def train_linear(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
) -> nn.Linear:
    """A linear classifier trained on fixed features: SGD with Nesterov momentum 0.9, cosine-decayed ``lr``, weight
    decay, cross-entropy; the weights start at N(0, 0.01) and the batches are drawn from a generator seeded by
    ``seed``, so the same inputs give the same classifier."""
    g = torch.Generator().manual_seed(seed)
    num, dim = features.shape
    linear = nn.Linear(dim, num_classes).to(features.device)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(num_classes, dim, generator=g) * 0.01)
        linear.bias.zero_()
    optimizer = torch.optim.SGD(linear.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    total_steps = max(epochs * math.ceil(num / batch_size), 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    with torch.enable_grad():  # a caller may hold no_grad (as feature extraction does): this part trains
        for _ in range(epochs):
            order = torch.randperm(num, generator=g).to(features.device)
            for start in range(0, num, batch_size):
                chosen = order[start : start + batch_size]
                loss = F.cross_entropy(linear(features[chosen]), labels[chosen])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    return linear.eval()


@torch.no_grad()
def top_k_accuracy(scores: Tensor, labels: Tensor, k: int = 1) -> float:
    """Percent of rows whose label is among the ``k`` highest scores."""
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return 100.0 * (top == labels[:, None]).any(1).float().mean().item()


# ---- kNN -------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def knn_scores(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    num_classes: int,
    k: int,
    temperature: float,
    chunk: int = 1024,
) -> Tensor:
    """Class scores (M, C) of each test feature by a weighted vote of its ``k`` nearest training features under
    cosine similarity, each neighbour weighing exp(similarity / temperature) (Wu et al., 2018; VISSL's and DINO's
    kNN benchmark). Test rows go in chunks, so only a (chunk, N) similarity matrix is ever held."""
    train = F.normalize(train_features, dim=1)
    test = F.normalize(test_features, dim=1)
    k = min(k, len(train))
    scores = torch.empty(len(test), num_classes, device=test.device)
    for start in range(0, len(test), chunk):
        similarity, neighbour = (test[start : start + chunk] @ train.T).topk(k, dim=1)
        weight = (similarity / temperature).exp()
        votes = torch.zeros(len(neighbour), num_classes, device=test.device)
        scores[start : start + chunk] = votes.scatter_add_(1, train_labels[neighbour], weight)
    return scores
