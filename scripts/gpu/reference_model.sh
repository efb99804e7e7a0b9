# Sourced by the GPU scripts: pretrain_gpt.py flags of the 1.42B reference GPT of shared/bench
# (24 layers, hidden 2048, 16 heads, ffn 8192, seq 2048, untied embeddings, no dropout), mock
# data, micro batch 2, global batch 16, bf16, distributed optimizer, overlapped reduction.
REFERENCE_MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
  --seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 --micro-batch-size 2
  --global-batch-size 16 --bf16 --use-distributed-optimizer --overlap-grad-reduce --lr 1e-4
  --eval-interval 0 --num-workers 0 --hidden-dropout 0 --attention-dropout 0)
