def test_device_out_of_memory_is_one_line_saying_what_was_asked_and_what_to_change():
    import jax

    from mesh_transformer.errors import out_of_memory_message

    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 47559058040 bytes.\nmore")
    message = out_of_memory_message(error)
    assert message.startswith("out of device memory (Out of memory allocating 47559058040 bytes.); ")
    assert "--dtype int8" in message and "--mp" in message and "--kv-pages auto" in message and "\n" not in message
    assert out_of_memory_message(jax.errors.JaxRuntimeError("INTERNAL: other")) is None
    assert out_of_memory_message(ValueError("RESOURCE_EXHAUSTED")) is None


def test_training_out_of_memory_names_the_training_keys_not_the_inference_flags():
    import jax

    from mesh_transformer.errors import TRAIN_OUT_OF_MEMORY_HINT, out_of_memory_message

    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\nmore")
    message = out_of_memory_message(error, TRAIN_OUT_OF_MEMORY_HINT)
    assert "per_replica_batch" in message and "gradient_accumulation_steps" in message and "--dtype" not in message
