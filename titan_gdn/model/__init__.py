from titan_gdn.model.args import Qwen35ModelArgs
from titan_gdn.model.flavors import qwen3_5_args
from titan_gdn.model.model import Qwen35Model
from titan_gdn.model.state_dict_adapter import Qwen35StateDictAdapter

__all__ = [
    "Qwen35Model",
    "Qwen35ModelArgs",
    "Qwen35StateDictAdapter",
    "qwen3_5_args",
]
