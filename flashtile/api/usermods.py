"""How flashtile.flex's score_mod / mask_mod pass through the custom ops: the mods (Triton functions and their
non-tensor values) stay in a registry under an integer key, which the ops carry (Problem.mod_key); their captured
tensors travel as op inputs, so autograd sees them. A leaf of the API: masks.py, interface.py and the ops read it."""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import torch

from ..kernels.params import UserMods

_REGISTRY: Dict[int, tuple] = {}
_KEYS: Dict[Tuple[int, int], int] = {}
_NEXT = itertools.count(1)


def captured_tensors(mod) -> List[torch.Tensor]:
    return [] if mod is None else [c for c in mod.captured if isinstance(c, torch.Tensor)]


def register(score_mod, mask_mod) -> Tuple[int, List[torch.Tensor]]:
    """(key, captured tensors: score_mod's, then mask_mod's) for the custom ops; the pair is kept alive here."""
    ids = (id(score_mod), id(mask_mod))
    key = _KEYS.get(ids)
    if key is None or _REGISTRY[key] != (score_mod, mask_mod):
        key = next(_NEXT)
        _KEYS[ids] = key
        _REGISTRY[key] = (score_mod, mask_mod)
    return key, captured_tensors(score_mod) + captured_tensors(mask_mod)


def aux(mod, tensors: List[torch.Tensor], start: int) -> Tuple[Optional[tuple], int]:
    """mod.captured with its tensors replaced by tensors[start:] (the op's own inputs); None if nothing."""
    if mod is None or not mod.captured:
        return None, start
    out = []
    for c in mod.captured:
        if isinstance(c, torch.Tensor):
            out.append(tensors[start])
            start += 1
        else:
            out.append(c)
    return tuple(out), start


def user_mods(key: int, tensors: List[torch.Tensor], grad_buffers: Optional[List[Optional[torch.Tensor]]] = None
              ) -> Optional[UserMods]:
    """The kernels' view of the mods registered under key (None for key 0). grad_buffers (backward): per captured
    tensor of the score_mod, a float32 buffer receiving its gradient; None when no captured tensor wants one, and
    then the kernels do not run the score_mod's captured_grad_fn."""
    if not key:
        return None
    score_mod, mask_mod = _REGISTRY[key]
    score_aux, n = aux(score_mod, tensors, 0)
    mask_aux, _ = aux(mask_mod, tensors, n)
    aux_grad = None
    if score_aux is not None and grad_buffers is not None:
        buffers = iter(grad_buffers)
        aux_grad = []
        for c, a in zip(score_mod.captured, score_aux):
            aux_grad.append(next(buffers) if isinstance(c, torch.Tensor) else a)
        aux_grad = tuple(aux_grad)
    if score_mod is None:
        return UserMods(mask_mod=mask_mod.fn if mask_mod else None, mask_aux=mask_aux)
    return UserMods(score_mod.fn, score_mod.grad_fn, score_mod.captured_grad_fn if aux_grad is not None else None,
                    score_aux, mask_mod.fn if mask_mod else None, mask_aux, aux_grad)


def n_score_tensors(key: int) -> int:
    """How many of the op's mod tensors are the score_mod's (they come first)."""
    return len(captured_tensors(_REGISTRY[key][0])) if key else 0
