"""radixserve's frontend language, after SGLang's: programs that interleave text,
generations, choices and chat turns, run against a server or an in-process engine.

    import radixserve.lang as rl

    @rl.function
    def qa(s, question):
        s += rl.system("You answer in one word.")
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=16, temperature=0))

    state = qa.run("Capital of France?", backend=rl.RuntimeEndpoint("http://127.0.0.1:8000"))
    state["answer"]
"""

from radixserve.lang.backends import Backend, ChatTemplate, EngineBackend, RuntimeEndpoint
from radixserve.lang.function import Function, function, set_default_backend
from radixserve.lang.primitives import LangError, assistant, gen, select, system, user
from radixserve.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "ChatTemplate",
    "EngineBackend",
    "ForkGroup",
    "Function",
    "LangError",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "select",
    "set_default_backend",
    "system",
    "user",
]
