"""gRPC server reflection `grpc.reflection.v1`, beside grpcio-reflection's `v1alpha`.

grpcio-reflection ships only v1alpha; clients such as grpcurl and Postman ask for v1 first. The two
protocols are the same messages under another package, so the same servicer answers both: v1 is
registered with v1alpha's (wire-identical) messages, and a copy of v1alpha's file descriptor,
renamed to v1, is added to the default pool so that the v1 service can describe itself too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection_pb2 as alpha

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(fdp)
    old = "." + alpha.DESCRIPTOR.package
    fdp.name, fdp.package = V1_FILE, V1_PACKAGE
    fdp.options.Clear()

    def rename(type_name: str) -> str:
        return "." + V1_PACKAGE + type_name[len(old):] if type_name.startswith(old + ".") else type_name

    for msg in fdp.message_type:
        for f in msg.field:
            if f.HasField("type_name"):
                f.type_name = rename(f.type_name)
    for service in fdp.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    pool.Add(fdp)


def add_v1_reflection(service_names, server: grpc.aio.Server) -> None:
    _register_v1_descriptor()
    servicer = reflection_aio.ReflectionServicer(service_names)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=alpha.ServerReflectionRequest.FromString,
            response_serializer=alpha.ServerReflectionResponse.SerializeToString),
    }),))
