"""The PrfaaS throughput model (paper eq. 3-8) and its solver, which the planner's decision asks.

Pure: no Kubernetes, HTTP, Prometheus or clock. The `plan` CLI and the planner's decision
(`prfaas_core.planning`, for the operator's loop and the simulator) ask the same two questions:
`evaluate` (what does this operating point sustain, and what binds?) and `solve_prfaas_pd`
(which operating point sustains the most?).
"""

from prfaas_core.throughput.model import (
    DecodeProfile,
    Evaluation,
    ModelForm,
    OperatingPoint,
    PlanError,
    Stage,
    SystemProfile,
    evaluate,
)
from prfaas_core.throughput.profile_file import ProfileDocument, ProfileFileError, parse_profile
from prfaas_core.throughput.report import Comparison, compare, render_table
from prfaas_core.throughput.solver import (
    DEFAULT_THRESHOLD_STEP_TOKENS,
    Plan,
    SolveDiagnostics,
    Strategy,
    solve_homogeneous_pd,
    solve_naive_heterogeneous,
    solve_prfaas_pd,
    threshold_grid,
)
from prfaas_core.throughput.workload import Workload, WorkloadError, parse_workload_spec

__all__ = [
    "DEFAULT_THRESHOLD_STEP_TOKENS",
    "Comparison",
    "DecodeProfile",
    "Evaluation",
    "ModelForm",
    "OperatingPoint",
    "Plan",
    "PlanError",
    "ProfileDocument",
    "ProfileFileError",
    "SolveDiagnostics",
    "Stage",
    "Strategy",
    "SystemProfile",
    "Workload",
    "WorkloadError",
    "compare",
    "evaluate",
    "parse_profile",
    "parse_workload_spec",
    "render_table",
    "solve_homogeneous_pd",
    "solve_naive_heterogeneous",
    "solve_prfaas_pd",
    "threshold_grid",
]
