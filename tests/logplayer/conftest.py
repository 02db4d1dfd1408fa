"""The LogPlayer's end-to-end tests (test_logplayer.py) run over both transports its client offers
(tests/support/transports.py): targets' data ports and gRPC; those about a data port name theirs."""

from tests.support.transports import client_transport, over_both_transports

__all__ = ["client_transport"]

pytest_generate_tests = over_both_transports(
    lambda module, test: module.endswith("test_logplayer") and "data_port" not in test
)
