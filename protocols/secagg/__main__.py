"""``python -m protocols.secagg``: the client's and the server's transition tables, as
docs/secure-aggregation.md shows them (a test keeps the two equal)."""

from protocols.secagg.client import CLIENT_TABLE
from protocols.secagg.server import SERVER_TABLE

print(f"{CLIENT_TABLE.render()}\n\n{SERVER_TABLE.render()}")
