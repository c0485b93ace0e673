"""The Ray Serve request router of ``parallm serve --ray``: Ray Serve's public request-router API
(``ray.serve.request_router.RequestRouter``) over the policy of :mod:`parallm_engine.serve.ray_routing`.

Ray runs one router per deployment handle, in the process that holds the handle: here the front deployment,
whose ``forward`` calls carry a :class:`~parallm_engine.serve.ray_routing.ForwardedRequest` as their argument, so
``choose_replicas`` sees the request's routing key (an HTTP request routed by Ray's proxy would reach the router
as an unread ASGI stream: the body is not there to route by). Ray then sends the request to the least loaded
replica of the first rank that is not full (``max_ongoing_requests``), and tells the router where it went and
when it finished.

Not Ray Serve LLM's ``PrefixCacheAffinityRouter``: it lives in ``ray.llm._internal`` (no stable API), matches the
concatenated message texts without roles or tools, keeps its tree in a detached actor and has no session
affinity; this router keeps its table in the front process (one front) and reads the same key for every API.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from parallm_engine.serve.ray_routing import (DEFAULT_MIN_MATCH_BLOCKS, DEFAULT_RECORD_BLOCKS, DEFAULT_SESSIONS, DEFAULT_SLACK, LRU,
                                               ForwardedRequest, RoutingTable)


def _forwarded(pending_request: Optional[PendingRequest]) -> ForwardedRequest | None:
    args = pending_request.args if pending_request is not None else None
    return args[0] if args and isinstance(args[0], ForwardedRequest) else None


class PrefixAffinityRouter(RequestRouter):
    """Longest recorded prefix, then session, then least loaded, within a bounded imbalance (``ray_routing``)."""

    def initialize_state(self, policy: str = "prefix", slack: int = DEFAULT_SLACK,
                         min_match_blocks: int = DEFAULT_MIN_MATCH_BLOCKS, record_blocks: int = DEFAULT_RECORD_BLOCKS,
                         sessions: int = DEFAULT_SESSIONS):
        self.table = RoutingTable(policy, slack=slack, min_match_blocks=min_match_blocks,
                                  record_blocks=record_blocks, sessions=sessions)
        self._reasons = LRU(100_000)  # internal request id -> why its replica was chosen
        self._routed_ids = LRU(100_000)  # requests this router placed (broadcasts are not), for their completion
        deployment = self._deployment_id
        if deployment is not None:
            # Ray ships this class to the front by value (cloudpickle): its module globals are a copy, so the
            # table is registered in the module the front imported.
            from parallm_engine.serve import ray_routing

            ray_routing.TABLES[(deployment.app_name, deployment.name)] = self.table

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        choice = self.table.choose(list(by_id), _forwarded(pending_request), request_id)
        if request_id is not None:
            self._reasons.put(request_id, choice.reason)
        return [[by_id[r] for r in rank if r in by_id] for rank in choice.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._routed_ids.put(request_id, replica_id.unique_id)
        self.table.routed(replica_id.unique_id, _forwarded(pending_request),
                          self._reasons.get(request_id, "least_loaded"), request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed_ids.pop(internal_request_id) is not None:
            self.table.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.table.set_replicas([r.unique_id for r in self._replicas])
