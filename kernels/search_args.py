"""The IVF search ops' structured arguments, with named fields.

`silverrec::ivf_search`, `silverrec::filtered_ivf_search` and `silverrec::filter_plan` take the index as a
tensor list and its integer parameters as an int list, and the request's filter programs as a tensor list,
in the orders kernels/constants.py defines (IVF_TENSORS, FILTERED_IVF_TENSORS, IVF_PARAMS,
FILTERED_IVF_PARAMS, PROGRAM_TENSORS). The retrieval stage builds them (silverrec/retrieval/ivf_index.py
`Int8IVFIndex.search_args`, filtered_ivf.py `FilteredIVFIndex.search_args`); the ops' Python paths read
them through the named tuples below, the C++ kernel through kernels/csrc/search_args.h, both by the
positions of the same definitions.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Sequence

from silverrec.kernels.constants import FILTERED_IVF_PARAMS, FILTERED_IVF_TENSORS, IVF_PARAMS, IVF_TENSORS, PROGRAM_TENSORS

IvfTensors = namedtuple("IvfTensors", IVF_TENSORS)
FilteredIvfTensors = namedtuple("FilteredIvfTensors", FILTERED_IVF_TENSORS)
IvfParams = namedtuple("IvfParams", IVF_PARAMS)
FilteredIvfParams = namedtuple("FilteredIvfParams", FILTERED_IVF_PARAMS)
Program = namedtuple("Program", PROGRAM_TENSORS)


def unpack(layout, values: Sequence, op: str, what: str):
    """`values` as the named tuple `layout`; a ValueError naming the op and the expected fields otherwise."""
    if len(values) != len(layout._fields):
        raise ValueError(f"{op}: {what} must hold {len(layout._fields)} entries ({', '.join(layout._fields)}), "
                         f"got {len(values)}")
    return layout(*values)
