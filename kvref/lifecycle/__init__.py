"""What a request forgets: `RequestLifecycle` (reset, remove, and the
prefix cache's reset), the manager delegating to it."""

from kvref.lifecycle.requests import RequestLifecycle as RequestLifecycle
