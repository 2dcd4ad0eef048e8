"""Pure pieces shared by the operator, the router and the simulator.

Nothing here touches Kubernetes, HTTP or the clock: the contracts between the parts
(router config, metrics names) and the fitted hardware profiles they all reason with.
"""
