"""Graph learning: torch_geometric's GraphSAGE trained on random graphs whose sizes span two
orders of magnitude (`graph`)."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from allocator_ext.workloads.base import Batch, Workload, generator, train_step


class GraphTraining(Workload):
    """Node classification with GraphSAGE (mean aggregation) on a random graph each step: its
    node count drawn log-uniformly from 1,000 to 100,000 (as often a small graph as a large
    one), each node with a random average number of random out-edges (4-16)."""

    name = "graph"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        from torch_geometric.nn import GraphSAGE

        self.features, hidden, layers, self.classes = (8, 16, 2, 4) if tiny else (128, 256, 3, 32)
        with torch.device(device):
            model = GraphSAGE(self.features, hidden, layers, self.classes)
        super().__init__(model, device, random.Random(seed))
        self.nodes = (20, 200) if tiny else (1_000, 100_000)
        self.degree = (2, 4) if tiny else (4, 16)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def draw(self, largest: bool = False) -> Batch:
        low, high = self.nodes
        if largest or self.fixed_shapes:
            nodes = high
        else:
            nodes = round(math.exp(self.rng.uniform(math.log(low), math.log(high))))
        edges = nodes * self._pick(self.degree, largest)
        g = generator(self.device, self._value_seed(largest))
        x = torch.randn(nodes, self.features, generator=g, device=self.device)
        edge_index = torch.randint(0, nodes, (2, edges), generator=g, device=self.device)
        y = torch.randint(0, self.classes, (nodes,), generator=g, device=self.device)
        return x, edge_index, y

    def run(self, batch: Batch) -> None:
        x, edge_index, y = batch
        train_step(self, F.cross_entropy(self.model(x, edge_index), y))


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    assert name == "graph", name
    return GraphTraining(device, tiny, seed)
