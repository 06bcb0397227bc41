"""The constants silverrec's Python, C++ and Triton code share, defined here once.

Python imports them from this module; the C++ kernels include kernels/csrc/constants.h, generated from
it (`python tools/gen_constants.py`; tests/test_constants.py regenerates the header and fails when the
checked-in one differs); the Triton kernels read them as `tl.constexpr` globals made from these values.
This module imports nothing, so that every layer (kernels, runtime, publish, tools) can read it.

What the generator writes for each public UPPER_CASE name: an int -> `constexpr int64_t kCamelCase`, a
float -> `constexpr double kCamelCase`, a tuple of ints -> `constexpr int64_t kCamelCase[n]`, a tuple of
names (an argument layout) -> `namespace snake_case { constexpr int64_t kField = position; ...; kCount }`.
"""

# ------------------------------------------------------------------ filter programs (kernels/bloom_filter.py)
# A program is postfix, one opcode per instruction (NOP padding): PUSH pushes the AND of its T bank rows
# (r >= 0: bits[r], r < 0: ~bits[~r]); AND / OR pop two results and push one; NOT replaces the top;
# FALSE / TRUE push a constant.
OP_NOP = 0
OP_PUSH = 1
OP_AND = 2
OP_OR = 3
OP_NOT = 4
OP_FALSE = 5
OP_TRUE = 6
OP_STACK_EFFECT = (0, 1, -1, -1, 0, 1, 1)  # stack depth change of each opcode, by opcode

# The filter language (kernels/csrc/filter_compiler.h): the kinds of a parsed filter's nodes, as the parser hands
# them to Python (prefix order), and the longest filter string it reads, in characters.
FILTER_NODE_TERM = 0  # feature = value, or feature IN (values)
FILTER_NODE_NOT = 1
FILTER_NODE_AND = 2
FILTER_NODE_OR = 3
FILTER_MAX_LENGTH = 1 << 16

# ------------------------------------------------------------------ the filtered search's routing
# Search modes: the request's choice per query (retrieval/filtered_ivf.py).
MODE_AUTO = 0  # filter_plan decides: probed, or the whole pool when probing would scan more
MODE_PROBED = 1  # exactly nprobe clusters, filtered
MODE_UNPROBED = 2  # the whole pool filtered, then an exact scan (posting lists when they qualify)

# Routes: filter_plan's decision per query.
ROUTE_PROBED = 0  # scan the probed clusters through the Bloom mask, then verify
ROUTE_WHOLE_POOL = 1  # filter the whole pool, exact scan of the passing rows
ROUTE_POSTING = 2  # filter the rows of the query's posting lists, exact scan of the passing rows

# The widening target: probe until the probed clusters hold k x match_factor / sqrt(d) matches, d the
# candidates' match density (retrieval/filtered_ivf.py, steps 4-5); the snapshot's default match_factor.
DEFAULT_MATCH_FACTOR = 8
# The probed route scans k + k / VERIFY_MARGIN_DIVISOR + VERIFY_MARGIN_ROWS rows, so that k remain after the
# exact verify program drops the Bloom filter's false positives.
VERIFY_MARGIN_DIVISOR = 4
VERIFY_MARGIN_ROWS = 16
# An exact route (whole pool, posting lists) of a re-scored search passing at most this many rows ranks all
# of them by the float query (kernels/rescore_rows.py): the exact float answer on the codes.
EXACT_FLOAT_ROWS = 1024

# ------------------------------------------------------------------ sentinels
NO_LISTS = -2  # lists[b, 0]: the query has no posting lists and filters the whole pool
NO_LIST = -1  # an unused slot of a query's posting lists
NO_ROW = -1  # a result slot holding no row (or item id): padding
NO_CLUSTER = -1  # a probe slot that scans nothing; as a range start (lo), a window not evaluated
EMPTY_KEY = -(1 << 63)  # the sort key of padding (kernels/common.py make_keys): after every item
BIAS_FLOOR = -(1 << 30)  # lowest per-(query, cluster) score bias of residual codes (kernels/common.py)

# ------------------------------------------------------------------ query quantisation (kernels/common.py)
QUERY_CODE_MAX = 127  # query codes lie in [-QUERY_CODE_MAX, QUERY_CODE_MAX]
QUERY_SCALE_FLOOR = 1e-30  # scale = max(amax |q|, QUERY_SCALE_FLOOR) / QUERY_CODE_MAX

# ------------------------------------------------------------------ the search ops' arguments
# silverrec::ivf_search and silverrec::filtered_ivf_search take the index as a tensor list and its integer
# parameters as one int list, in these orders (kernels/filtered_ivf_search.py); the filtered index's lists
# extend the plain one's. The request's filter program is a tensor list too.
IVF_TENSORS = ("codes", "dim_scale", "dim_offset", "cluster_offsets", "centroids", "row_to_item")
FILTERED_IVF_TENSORS = IVF_TENSORS + ("bits", "post_rows", "post_offsets", "post_sizes")
IVF_PARAMS = ("window_words", "residual")
FILTERED_IVF_PARAMS = IVF_PARAMS + ("match_factor", "num_items", "posting_limit")
PROGRAM_TENSORS = ("ops", "rows", "vops", "vrows", "lists")
# silverrec::mol_score: the MoL OverArch's weights as a tensor list, its sizes as an int list.
MOL_WEIGHTS = ("user_weight", "user_bias", "gate_in_weight", "gate_weight", "gate_bias", "dot_scale", "log_scale")
MOL_DIMS = ("p_q", "p_x", "comp_dim", "feat_dim")

# ------------------------------------------------------------------ value model (silverrec/ranking/value_model.py)
# Postfix instructions (opcode, argument index, constant).
VALUE_OP_CONST = 0  # push the constant
VALUE_OP_TASK = 1  # push task_scores[:, :, arg]
VALUE_OP_FEATURE = 2  # push feats[:, :, arg]
VALUE_OP_SIGMOID = 3  # unary
VALUE_OP_NOT = 4  # unary: 1.0 where x == 0
VALUE_OP_BOOL = 5  # unary: 1.0 where x != 0 (a one-term and / or)
VALUE_OP_POW = 6  # unary: x ** constant, 0 where not finite
VALUE_OP_ADD = 7  # binary ops pop b, then a, and push a OP b
VALUE_OP_MUL = 8
VALUE_OP_SUB = 9
VALUE_OP_DIV = 10  # 0 where b == 0
VALUE_OP_MIN = 11
VALUE_OP_MAX = 12
VALUE_OP_GT = 13
VALUE_OP_GE = 14
VALUE_OP_LT = 15
VALUE_OP_LE = 16
VALUE_OP_EQ = 17
VALUE_OP_AND = 18
VALUE_OP_OR = 19
VALUE_OP_CLAMP = 20  # pops hi, lo, x
VALUE_OP_IF = 21  # pops else, then, cond
