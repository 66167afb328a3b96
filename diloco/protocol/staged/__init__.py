"""Bounded groups: a large round run in stages over a grid::

grid       pure: members placed on a grid, the plan of stages
reference  pure: the in-process reducer following a plan (tests and benchmarks)
groups     a stage group's id and GroupInfo from the GROUP and the plan
runner     the staged round over the wire: one all-reduce per stage
views      the stage groups run when a member is lost mid-stage
"""
