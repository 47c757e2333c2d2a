"""Small runtime pieces shared by the agent and the controller (they never import each
other): the event-loop lag monitor (:mod:`.looplag`), the asyncio task count
(:mod:`.tasks`) and waits with a deadline that never swallow a cancel (:mod:`.deadlines`).
Imports no agent, controller, demo or cli (import-linter)."""
