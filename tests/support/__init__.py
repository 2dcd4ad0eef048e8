"""What tests of every tier share: sample objects, cases, strategies, kubectl, SSE and raw HTTP.

The bounded poll and free ports are the testbed's (prfaas_testbed.polling, prfaas_testbed.ports): the demo uses them too.
"""
