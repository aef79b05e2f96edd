"""How flashtile.flex's score_mod / mask_mod pass through the custom ops: the mods (Triton functions and their
non-tensor values) stay in a registry under an integer key, which the ops carry (Problem.mod_key); their captured
tensors travel as op inputs, so autograd sees them. A leaf of the API: masks.py, interface.py and the ops read it."""
from __future__ import annotations

import itertools
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ..kernels.params import UserMods

# key -> (score_mod's, mask_mod's) _Static; a pair's _key -> its key
_REGISTRY: Dict[int, tuple] = {}
_KEYS: Dict[tuple, int] = {}
_NEXT = itertools.count(1)
TENSOR = "<captured tensor>"   # a captured tensor's place in a _Static's captured values (the op's input there)


class _Static(NamedTuple):
    """What of a ScoreMod / MaskMod the kernels compile in or take as values: its functions and captured values,
    the captured tensors' places marked TENSOR (they are the op's inputs)."""
    fn: object
    grad_fn: object
    captured_grad_fn: object
    captured: tuple


def _static(mod) -> Optional[_Static]:
    if mod is None:
        return None
    return _Static(mod.fn, getattr(mod, "grad_fn", None), getattr(mod, "captured_grad_fn", None),
                   tuple(TENSOR if isinstance(c, torch.Tensor) else c for c in mod.captured))


def _key(mod):
    """A mod's _Static spelled exactly, without building it (register's lookup, every call): an int and a float
    apart (Triton specializes them apart; 1 == 1.0 as keys), a float by its bits (-0.0 is not 0.0, and a NaN
    equals itself)."""
    if mod is None:
        return None
    return (mod.fn, getattr(mod, "grad_fn", None), getattr(mod, "captured_grad_fn", None),
            tuple(TENSOR if isinstance(c, torch.Tensor) else c.hex() if type(c) is float else (type(c), c)
                  for c in mod.captured))


def captured_tensors(mod) -> List[torch.Tensor]:
    return [] if mod is None else [c for c in mod.captured if isinstance(c, torch.Tensor)]


def register(score_mod, mask_mod) -> Tuple[int, List[torch.Tensor]]:
    """(key, captured tensors: score_mod's, then mask_mod's) for the custom ops. Mods equal but for their captured
    tensors (e.g. document_mask over each batch's document ids) share a key, and so a problem, its plans and
    launch templates; the registry holds no tensor."""
    sig = (_key(score_mod), _key(mask_mod))
    key = _KEYS.get(sig)
    if key is None:
        key = _KEYS[sig] = next(_NEXT)
        _REGISTRY[key] = (_static(score_mod), _static(mask_mod))
    return key, captured_tensors(score_mod) + captured_tensors(mask_mod)


def aux(mod: Optional[_Static], tensors: List[torch.Tensor], start: int) -> Tuple[Optional[tuple], int]:
    """A registered mod's captured values with its tensors' places filled from tensors[start:] (the op's own
    inputs); None if nothing."""
    if mod is None or not mod.captured:
        return None, start
    out = []
    for c in mod.captured:
        if c is TENSOR:
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
            aux_grad.append(next(buffers) if c is TENSOR else a)
        aux_grad = tuple(aux_grad)
    if score_mod is None:
        return UserMods(mask_mod=mask_mod.fn if mask_mod else None, mask_aux=mask_aux)
    return UserMods(score_mod.fn, score_mod.grad_fn, score_mod.captured_grad_fn if aux_grad is not None else None,
                    score_aux, mask_mod.fn if mask_mod else None, mask_aux, aux_grad)


def n_score_tensors(key: int) -> int:
    """How many of the op's mod tensors are the score_mod's (they come first)."""
    return _REGISTRY[key][0].captured.count(TENSOR) if key and _REGISTRY[key][0] is not None else 0
