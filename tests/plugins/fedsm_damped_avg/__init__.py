"""A weight method from outside the product, installed as a plugin (``fedsm.methods`` entry point).

Nothing here edits a product file: the entry below is registered by ``engine.catalogue`` in every
process that finds this distribution on its path (the tests put ``tests/plugins`` there), and
:mod:`fedsm_damped_avg.method` holds the class, imported only when the method is built.
"""

from engine.catalogue import WeightMethod

NAME = "test-damped-avg"

ENTRY = WeightMethod(NAME, "Damped FedAvg (test)", "fedsm_damped_avg.method:DampedAvg", compared_with=("fedavg",))
