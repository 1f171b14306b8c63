"""How chat models write what is not plain text, shared by the tokenizer service
(`prep`), the gateway (`api`) and the in-process `Engine.chat`:

tool_prompt.py       tools and earlier calls as the chat template's inputs (or written
                     into the system message in the Hermes format), strict tools' tag
tool_calls.py        calls read back from model text (Hermes / Qwen, Mistral, Llama 3),
                     whole or streamed; OpenAI's `tool_calls` entry
arguments_stream.py  a call's arguments streamed as the model writes them, any format
reasoning.py         `<think>` reasoning split from the content, whole or streamed

Pure text: no torch, no HTTP, no tokenizer.
"""
