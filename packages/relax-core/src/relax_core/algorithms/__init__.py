"""The RL math: the algorithm table (``table``), advantage estimators (``advantages``) and the trainer-facing
advantage step (``estimate``), policy surrogates and off-policy corrections (``policy_losses``) and the whole
policy objective (``loss``), KL, entropy and value loss (``kl``), masked reductions (``masked``).

Only ``table`` loads without torch (the configs read it); :mod:`relax_core` imports the others on first use
of one of their names. Import the public names from :mod:`relax_core`; these modules are its internals.
"""
