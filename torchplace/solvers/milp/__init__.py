"""Mixed-integer programs in Pyomo, solved by HiGHS (see :mod:`torchplace.solvers.milp.highs`).

Each model is ``build(problem) -> ConcreteModel``, ``solve_model`` and ``extract`` -> Plan, after
STYLE.md: Sets, Params, Vars, Objective, Constraints; big-M constants derived from the data.
"""
