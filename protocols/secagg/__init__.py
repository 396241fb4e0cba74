"""Secure aggregation (SecAgg, Bonawitz et al. CCS 2017) with the SecAgg+ sparse-graph option
(Bell et al. CCS 2020), as sans-IO state machines for both sides.

Integration sketch (the lead's transport carries `to_wire()` output in its envelope):

    config = RoundConfig.create(job_id=..., round_id=..., group_id=..., aggregator_id=...,
                                members=device_ids, vector_length=m, bound=B)   # graph="auto"
    server = ServerSecAgg(config, aggregator_identity, enrolled_registry)
    send_all(server.start())
    on upload (header, arrays): send_all(server.handle(decode(header, arrays)))
    on phase timer:             send_all(server.handle(Timeout(server.phase)))
    result: AggregateReady (result.decode() -> float64 sum) or RoundFailed in the outputs

    client = ClientSecAgg(identity, aggregator_id, aggregator_public_key,
                          job_id=..., round_id=..., group_id=..., input_vector=x)
    on download: send_all(client.handle(decode(header, arrays)))

See protocols/secagg/driver.py for a complete in-memory run and docs/secure-aggregation.md.
"""

from .client import ClientSecAgg, ClientState, ReleaseGuard
from .config import GRAPH_AUTO, GRAPH_COMPLETE, GRAPH_REGULAR, RoundConfig
from .errors import (AuthenticationError, BadSignature, ConfigError, DecryptionError, InputError,
                     MalformedMessage, ProtocolViolation, ReconstructionError, ReleaseRefused, ReplayedMessage,
                     SecAggError,
                     UnexpectedMessage, UnknownSender, WrongContext)
from .events import AggregateReady, MemberOffline, Phase, RoundFailed, Timeout
from .fixedpoint import FixedPointCodec, fed3r_bound, max_scale_bits
from .graph import NeighbourGraph, default_degree
from .messages import (AdvertiseKeys, ConsistencyCheckRequest, ConsistencySignature, EncryptedShares,
                       ForwardedShares, KeyDirectory, MaskedInput, Message, RoundAborted, RoundStart,
                       ShareAccusation, UnmaskRequest, UnmaskShares, decode)
from .server import MaskApplier, ServerSecAgg, ServerState

__all__ = [
    "ClientSecAgg", "ClientState", "ServerSecAgg", "ServerState", "MaskApplier", "RoundConfig", "GRAPH_AUTO", "GRAPH_COMPLETE",
    "GRAPH_REGULAR",
    "Phase", "Timeout", "MemberOffline", "AggregateReady", "RoundFailed", "FixedPointCodec", "fed3r_bound", "max_scale_bits",
    "NeighbourGraph", "default_degree", "Message", "decode", "RoundStart", "KeyDirectory", "ForwardedShares",
    "ConsistencyCheckRequest", "UnmaskRequest", "RoundAborted", "AdvertiseKeys", "EncryptedShares", "MaskedInput",
    "ConsistencySignature", "UnmaskShares", "ShareAccusation", "SecAggError", "ConfigError", "InputError", "MalformedMessage",
    "AuthenticationError", "UnknownSender", "BadSignature", "WrongContext", "UnexpectedMessage",
    "ReplayedMessage", "DecryptionError", "ProtocolViolation", "ReconstructionError",
    "ReleaseRefused", "ReleaseGuard",
]
