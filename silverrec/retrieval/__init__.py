"""Retrieval: the user tower and the int8 IVF / exact indexes, with the filtered search over them."""
