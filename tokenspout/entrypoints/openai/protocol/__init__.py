"""OpenAI API request / response models, the error shape, and the request → SamplingParams mapping.

Unknown request fields are rejected with a 400 naming them (a field the server silently ignored would change what
the client meant); README "Coming from vLLM" lists what is supported.  Range checks live in SamplingParams (one source of
truth); only what SamplingParams cannot know (OpenAI's top_logprobs / logprobs bounds, message shapes) is checked here.

One module per job: errors (the error shape), sampling (what both routes' requests share and its SamplingParams
mapping), chat, completion, common (response pieces both routes use, /v1/models).  Import from here: this package
is the public path.
"""

from tokenspout.entrypoints.openai.protocol.chat import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTool,
    ContentPart,
    DeltaMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from tokenspout.entrypoints.openai.protocol.common import (
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobsJSON,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from tokenspout.entrypoints.openai.protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenspout.entrypoints.openai.protocol.errors import (
    ErrorInfo,
    ErrorResponse,
    OpenAIServingError,
    validation_error_to_serving_error,
    value_error_to_serving_error,
)
from tokenspout.entrypoints.openai.protocol.sampling import (
    MAX_N,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingRequest,
    StreamOptions,
    StructuredOutputsRequest,
    to_sampling_params,
)

__all__ = [
    "MAX_N", "ChatChoiceLogprobs", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatCompletionStreamChoice", "ChatMessage", "ChatResponseMessage", "ChatTokenLogprob",
    "ChatTool", "CompletionChoice", "CompletionLogprobs", "CompletionRequest", "CompletionResponse", "ContentPart",
    "DeltaMessage", "ErrorInfo", "ErrorResponse", "FunctionCall", "FunctionDefinition", "JsonSchemaFormat",
    "ModelCard", "ModelList", "NamedFunction", "NamedToolChoice", "OpenAIServingError", "PromptLogprob",
    "PromptLogprobsJSON", "PromptTokensDetails", "ResponseFormat", "SamplingRequest", "StreamOptions",
    "StructuredOutputsRequest", "ToolCall", "TopLogprob", "UsageInfo", "to_sampling_params",
    "validation_error_to_serving_error", "value_error_to_serving_error",
]
