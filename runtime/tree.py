"""Token trees as a verify step sees them.

A tree proposal is N nodes (token, parent) under the pending token, the root; parents[i] is 0 for a child of
the root and j + 1 for a child of node j (the convention of tree_acceptance.py). The verify step feeds the
root and then the nodes in index order: step row 0 is the root, row i + 1 is node i, at position
cache_len + depth, seeing its ancestors and itself (`step_mask`).

Which trees verify exactly: a row is computed bit for bit like one-token decode when its ancestors sit in
the step's first rows, in order, because the graph puts step row j's key and value at cache slot
cache_len + j, where a later decode step would find the j-th committed token (docs/bundle.md). That holds
for every node of a *spine plus leaves* tree: a chain (nodes 0..L-1, each the child of the one before) plus
leaves, nodes without children whose parent is the root or a chain node. So greedy speculation over such
trees equals plain decode token for token, and the proposers build only those (`spine_plus_leaves`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TreeLayout:
    tokens: list[int]  # [N+1]: the root (pending token), then the nodes
    depth: np.ndarray  # int64 [N+1]: 0 for the root
    sees: np.ndarray  # bool [N+1, N+1]: row r sees row c iff c is r or an ancestor of r

    @classmethod
    def build(cls, root: int, tokens: list[int], parents: list[int]) -> "TreeLayout":
        n = len(tokens)
        depth = np.zeros(n + 1, np.int64)
        sees = np.eye(n + 1, dtype=bool)
        for i, p in enumerate(parents):
            if not 0 <= p <= i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
            depth[i + 1] = depth[p] + 1
            sees[i + 1] = sees[p]
            sees[i + 1, i + 1] = True
        return cls([int(root)] + [int(t) for t in tokens], depth, sees)

    def prefixes(self) -> list[list[int]]:
        """For each row, the node tokens it follows from the root down (row 0: none; row i+1: node i's path)."""
        return [[self.tokens[c] for c in np.flatnonzero(row[1:]) + 1] for row in self.sees]


def spine_length(parents: list[int]) -> int:
    """Nodes 0..L-1 form the first chain (node i's parent is node i-1, node 0's the root)."""
    n = 0
    while n < len(parents) and parents[n] == n:
        n += 1
    return n


def spine_and_leaves(nodes: int) -> list[int]:
    """Parents of a spine-plus-leaves tree of `nodes` nodes, for graphs run without a proposer (calibration,
    `specedge check`): the first half of the nodes (at least one) a spine, the rest leaves hanging off the root
    and the spine nodes in turn."""
    spine = min(nodes, max(1, nodes // 2))
    return list(range(spine)) + [k % (spine + 1) for k in range(nodes - spine)]


def spine_plus_leaves(parents: list[int]) -> bool:
    """Whether every node is on the first chain or is a leaf hanging off the root or the chain."""
    spine = spine_length(parents)
    return all(p <= spine for p in parents[spine:])
