"""The client's exception tree, under the name scripts import it by: the classes are
:mod:`smb_protocol.errors`' (client and server share one vocabulary)."""
from smb_protocol.errors import *  # noqa: F403
from smb_protocol.errors import __all__  # noqa: F401
