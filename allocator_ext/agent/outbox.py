"""A bounded queue between the sampler and the gRPC stream: it never blocks the producer.

When full, the oldest report is dropped and counted: reports are cumulative, so the newest one
carries everything the dropped ones had. Command results go into a separate lane that is sent
first and kept (they are few, and the sidecar waits for them).
"""

from __future__ import annotations

import collections
import threading

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb


class Outbox:
    def __init__(self, capacity: int = 32, results_capacity: int = 64):
        self._reports: collections.deque[pb.AgentMessage] = collections.deque()
        self._results: collections.deque[pb.AgentMessage] = collections.deque()
        self._capacity = capacity
        self._results_capacity = results_capacity
        self._cond = threading.Condition()
        self.dropped = 0

    def put_report(self, message: pb.AgentMessage) -> None:
        with self._cond:
            if len(self._reports) >= self._capacity:
                self._reports.popleft()
                self.dropped += 1
            self._reports.append(message)
            self._cond.notify()

    def put_result(self, message: pb.AgentMessage) -> None:
        with self._cond:
            if len(self._results) >= self._results_capacity:
                self._results.popleft()
            self._results.append(message)
            self._cond.notify()

    def get(self, timeout: float) -> pb.AgentMessage | None:
        with self._cond:
            if not self._results and not self._reports:
                self._cond.wait(timeout)
            if self._results:
                return self._results.popleft()
            if self._reports:
                return self._reports.popleft()
            return None

    def __len__(self) -> int:
        with self._cond:
            return len(self._reports) + len(self._results)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
