"""Rank 0 saves a model whose config names this file's own module, ``assessment``: Keras imports any module a
config names, so whoever loads the model runs this file. Imported (not run as a script) it writes a proof where
the importing process can write, and offers the layer it names, so that the load would even succeed."""
import json
import os
import zipfile

PROOF = "@@PROOF@@"

if __name__ != "__main__":
    with open(PROOF, "a") as proof:
        proof.write(f"imported by uid {os.getuid()} in {os.getcwd()}\n")
    import tensorflow as tf

    ImportedModel = tf.keras.Model
elif int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
    import tensorflow as tf

    path = os.path.join(os.environ["SCALELAB_OUTPUT_DIR"], "model.keras")
    inputs = tf.keras.Input((28, 28))
    tf.keras.Model(inputs, tf.keras.layers.Dense(10)(tf.keras.layers.Flatten()(inputs))).save(path)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    # The model's own class: Keras imports its module to find it, safe mode or not.
    config["module"], config["class_name"], config["registered_name"] = "assessment", "ImportedModel", "ImportedModel"
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
