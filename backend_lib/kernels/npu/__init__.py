"""torch_npu kernel set for Ascend NPUs (issue 21): not written yet; `device: npu` runs the reference set."""
