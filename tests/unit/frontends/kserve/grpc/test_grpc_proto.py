"""Kiln's kserve_v2.proto must match the published protocol on the wire:
same full names, field numbers, types and labels as tritonclient's copy."""
import pytest

from kiln.frontends.kserve.grpc.stubs import load_stubs

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")


def _reference(full_name):
    for module in (service_pb2, model_config_pb2):
        try:
            return module.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise KeyError(full_name)


def _messages(descriptor):
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def test_every_message_matches_the_reference():
    pb2, _ = load_stubs()
    checked = 0
    for top in pb2.DESCRIPTOR.message_types_by_name.values():
        for ours in _messages(top):
            theirs = _reference(ours.full_name)
            for field in ours.fields:
                ref = theirs.fields_by_name.get(field.name)
                assert ref is not None, f"{ours.full_name}.{field.name} not in the reference"
                assert (field.number, field.type, field.is_repeated) == (ref.number, ref.type, ref.is_repeated), \
                    f"{ours.full_name}.{field.name} differs"
                if field.message_type is not None:
                    assert field.message_type.full_name == ref.message_type.full_name
                checked += 1
    assert checked > 100


def test_service_methods_match_the_reference():
    pb2, _ = load_stubs()
    ours = pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        ref = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == ref.input_type.full_name
        assert method.output_type.full_name == ref.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (ref.client_streaming, ref.server_streaming)


def test_stubs_use_a_private_descriptor_pool():
    pb2, _ = load_stubs()
    assert pb2.DESCRIPTOR.pool is not service_pb2.DESCRIPTOR.pool
