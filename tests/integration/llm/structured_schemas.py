"""JSON schemas the structured-output tests and bench/structured_outputs.py use:
nested objects, arrays, enums, required fields, string formats, bounded numbers."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "email", "address"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "measurement": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "format": "date"},
            "celsius": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "station": {"enum": ["north", "south"]},
            "ok": {"type": "boolean"},
        },
        "required": ["date", "celsius", "humidity", "station", "ok"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {
            "title": NAME,
            "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech", "art"]}, "maxItems": 4},
            "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]},
        },
        "required": ["title", "tags", "score"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "person": "Describe a fictional person as JSON (name, age, email, address with city and zip).",
    "order": "Give an example shop order as JSON with an id, a status and a list of items.",
    "measurement": "Give one weather measurement as JSON: date, celsius, humidity, station, ok.",
    "tags": "Give a news headline as JSON with a title, a list of tags and a score.",
}
