export PYTHONPATH=/tmp/site:$PWD
echo "== objects defining _M_insert<long>"
for o in $(find build -name "*.o"); do nm -C --defined-only $o 2>/dev/null | grep -q "_M_insert<long>" && echo "$o"; done
nm -C -D --defined-only veloce/_C.abi3.so | grep -c "std::" 
nm -C veloce/_C.abi3.so | grep "_M_insert<long>" | head -3
ldd veloce/_C.abi3.so | grep -i "stdc\|c10\|torch" | head
python3 -c "import torch, os; print(torch.__file__)"; ls /opt/torch/.venv/lib/python3.12/site-packages/torch/lib | grep -i stdc
gcc --version | head -1; strings /lib/x86_64-linux-gnu/libstdc++.so.6 | grep GLIBCXX_3.4.3 | tail -2
