"""Context curriculum: one run walked through stages of growing context length (GLM-5: 4K -> 32K -> 128K -> 200K).

GLM-5 pretrains at 4K tokens, then mid-trains at 32K (1T tokens), 128K (500B) and 200K (50B) with long
documents up-sampled, and adapts the dense model to DeepSeek Sparse Attention at the end (GLM-5
report, sections on mid-training and DSA; `configs/curriculum/glm5-744b.yaml`). A plan
(`plan.py`) lists the stages: each is an ordinary training config plus a context length, a token
budget and a batch size in tokens; every stage's config is built and validated before anything
runs. The runner (`runner.py`) trains the stages in order, each from the previous stage's final
weights (`checkpoint.pretrained`), optionally with its optimizer state, and skips finished stages
when restarted (a stage killed midway resumes from its own checkpoints: the loop's exact resume).

    python -m pretrain.curriculum --plan configs/curriculum/tiny.yaml [--launcher inline] [overrides]
    bash launch/curriculum.sh --plan configs/curriculum/glm5-proxy.yaml
"""

from pretrain.curriculum.plan import Plan, PlanError, Stage, load_plan

__all__ = ["Plan", "PlanError", "Stage", "load_plan"]
