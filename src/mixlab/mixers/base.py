"""The one mixer contract every sequence mixer follows."""

from __future__ import annotations

from torch import Tensor, nn

from mixlab.coords import Coords

__all__ = ["Mixer", "check_choice", "check_sizes"]


def check_sizes(mixer: str, minimum: int = 1, **sizes: int | None) -> None:
    """Raise ``ValueError`` naming the first size argument that is not ``None`` and below
    ``minimum`` (1 for widths and ranks; 0 where 0 switches a part off, e.g. ``conv_size``).

    Raises:
        ValueError: ``"<mixer> mixer: <name> must be an integer >= <minimum>; got <value>"``.
    """
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
            raise ValueError(f"{mixer} mixer: {name} must be an integer >= {minimum}; got {value!r}")


def check_choice(mixer: str, name: str, value: object, choices: tuple) -> None:
    """Raise ``ValueError`` if ``value`` is not one of ``choices`` (e.g. an ``impl`` typo).

    Raises:
        ValueError: ``"<mixer> mixer: <name> must be one of (...); got <value>"``.
    """
    if value not in choices:
        raise ValueError(f"{mixer} mixer: {name} must be one of {choices}; got {value!r}")


class Mixer(nn.Module):
    """Base class for all mixers (attention, delta rules, Mesa, SSMs).

    Contract::

        y = mixer(x, coords=None, cache=None)

    Args:
        x: ``[B, T, D]`` float (any dtype the weights accept under autocast).
        coords: :class:`~mixlab.coords.Coords` with ``[B|1, T, A]`` integer coordinates;
            ``None`` means ``Coords.seq(T)``. Recurrent mixers may ignore it.
        cache: ``None`` for a parallel forward, or a per-layer ``dict`` the mixer reads
            and updates in place (attention: keys/values; recurrent mixers: their state).
            Decoding token by token with a cache must equal the parallel forward.

    Returns:
        ``[B, T, D]``, same dtype as the mixer's output projection.

    Constructor keywords shared by all mixers: ``d_model``, ``n_heads``, ``causal``,
    ``layer_idx``, ``n_layers``; the rest are the mixer's own (``mixer_args`` in configs).
    Output projections that write into the residual stream set ``_is_residual = True``
    so the backbone scales their init by ``1/sqrt(2 n_layers)`` (GPT-2 style). Parameters
    that must not be weight-decayed carry ``_no_weight_decay = True``. A mixer with custom
    initialisation implements ``reset_parameters()``; the backbone calls it after the
    generic init.
    """

    causal: bool = True

    def extra_metrics(self) -> dict[str, Tensor]:
        """Scalars to log after a step (e.g. Mesa CG iterations); empty by default."""
        return {}
