"""Rewards: the built-in functions (``basic``, ``extras``), the registry and the reward-function protocols
(``registry``), loading and calling user functions (``user``), HTTP rewards (``remote``) and the runner that
routes, bounds and counts every call (``runner``).

Nothing here imports torch. Import the public names from :mod:`relax_core`; these modules are its internals.
"""
