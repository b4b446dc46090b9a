"""Request fields that constrain the output to a grammar, mapped onto StructuredOutputsParams.

Accepted forms (at most one per request):
* OpenAI `response_format`: {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}} | {"type": "text"} (no constraint);
* vLLM's extras: `guided_json` (schema object or string), `guided_regex`, `guided_choice` (list of strings),
  `guided_grammar` (Lark / GBNF as llguidance accepts);
* one `structured_outputs` object: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
"""

from __future__ import annotations

import json
from typing import Any

from tokenspout.sampling_params import StructuredOutputsParams


def _schema_text(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        return schema
    if isinstance(schema, dict | bool):
        return json.dumps(schema)
    raise ValueError(f"{field} must be a JSON schema object")


def structured_outputs_from_request(req: Any) -> StructuredOutputsParams | None:
    """`req`'s fields are already type-checked by the request models (protocol.py); this maps them and checks
    what types cannot say (one constraint per request, JSON text that parses)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            found.append(("response_format",
                          StructuredOutputsParams(json=_schema_text(rf.json_schema.schema_,
                                                                    "response_format.json_schema"))))
    if getattr(req, "guided_json", None) is not None:
        found.append(("guided_json", StructuredOutputsParams(json=_schema_text(req.guided_json, "guided_json"))))
    if getattr(req, "guided_regex", None) is not None:
        found.append(("guided_regex", StructuredOutputsParams(regex=req.guided_regex)))
    if getattr(req, "guided_choice", None) is not None:
        if not req.guided_choice:
            raise ValueError("guided_choice must be a non-empty list of strings")
        found.append(("guided_choice", StructuredOutputsParams(choice=list(req.guided_choice))))
    if getattr(req, "guided_grammar", None) is not None:
        found.append(("guided_grammar", StructuredOutputsParams(grammar=req.guided_grammar)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        schema = None if so.json_ is None else _schema_text(so.json_, "structured_outputs.json")
        found.append(("structured_outputs", StructuredOutputsParams(
            json=schema, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object))))
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one of response_format, guided_json, guided_regex, guided_choice, "
                         f"guided_grammar, structured_outputs may be given")
    if not found:
        return None
    name, params = found[0]
    params.source = name
    return params
