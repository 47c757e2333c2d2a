"""Small runtime pieces shared by the agent and the controller (they never import each
other): the event-loop lag monitor (:mod:`.looplag`) and the asyncio task count
(:mod:`.tasks`).  Imports no agent, controller, demo
or cli (import-linter)."""
